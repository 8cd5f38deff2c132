"""The seed's upload form (``multipart/form-data`` with a ``file`` field), streamed.

Starlette's own ``request.form()`` spools a file field to a temp file before the route sees
it: a second copy of a model of many GB, in /tmp. Here python-multipart's streaming parser
hands the ``file`` field's bytes straight to the upload as they arrive, and keeps the small
fields (``id``, ``sha256``) it meets on the way.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header

from shoal.data.errors import BadRequest

FILE_FIELD = "file"
MAX_FIELD_BYTES = 1024
"""The largest other field (an id, a sha256) the form may carry."""
MAX_FIELDS = 16


def is_form(content_type: str | None) -> bool:
    return content_type is not None and content_type.lower().startswith("multipart/form-data")


class FormUpload:
    """The form of one request: ``file_bytes()`` yields its file; ``fields`` and
    ``filename`` are known once it has been read to the end."""

    def __init__(self, content_type: str, body: AsyncIterable[bytes]) -> None:
        _, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if not boundary:
            raise BadRequest(
                "The multipart form has no boundary in its Content-Type. Send the file as "
                "multipart/form-data (curl -F file=@MODEL.gguf) or as the raw body."
            )
        self.body = body
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._files = 0
        self._out: list[bytes] = []
        self._name: str | None = None
        self._value = bytearray()
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field_data,
                "on_header_value": self._header_value_data,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    async def file_bytes(self) -> AsyncIterator[bytes]:
        """The ``file`` field's bytes, as the request body arrives."""
        async for chunk in self.body:
            self._feed(chunk)
            if self._out:
                data = b"".join(self._out)
                self._out.clear()
                yield data
        try:
            self._parser.finalize()
        except MultipartParseError as exc:
            raise _malformed(exc) from None
        if self._out:
            yield b"".join(self._out)
            self._out.clear()
        if not self._files:
            raise BadRequest(
                f"The form has no '{FILE_FIELD}' field. Send the model as "
                f"{FILE_FIELD}=@MODEL.gguf (curl -F), or as the raw body.",
                param=FILE_FIELD,
            )

    def _feed(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise _malformed(exc) from None

    # python-multipart's callbacks

    def _part_begin(self) -> None:
        self._headers = {}
        self._name = None
        self._value.clear()

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_field.decode("latin-1").lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get("content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", errors="replace")
        self._name = name
        if name == FILE_FIELD:
            self._files += 1
            if self._files > 1:
                raise BadRequest("The form carries more than one file; send one model at a time.")
            filename = params.get(b"filename")
            self.filename = filename.decode("utf-8", errors="replace") if filename else None
        elif len(self.fields) >= MAX_FIELDS:
            raise BadRequest(f"The form has more than {MAX_FIELDS} fields.")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == FILE_FIELD:
            self._out.append(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise BadRequest(
                f"The form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes; only "
                f"'{FILE_FIELD}' may be large."
            )

    def _part_end(self) -> None:
        if self._name and self._name != FILE_FIELD:
            self.fields[self._name] = self._value.decode("utf-8", errors="replace").strip()


def _malformed(exc: Exception) -> BadRequest:
    return BadRequest(
        f"The multipart form is malformed ({exc}). Send the model as file=@MODEL.gguf "
        "(curl -F), or as the raw body."
    )
