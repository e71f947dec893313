"""OpenAI's Files API (``/v1/files``): uploads as multipart forms, kept in ``[batch] dir``
(``conveyor.batches.files``), listed, read back and deleted."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio
import msgspec
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response

from conveyor.batches.files import UPLOAD_PURPOSES, FileStore, FileTooLarge
from conveyor.plugins.transport.server_routes import ServerRoutes
from conveyor.plugins.transport.sse import error_response, json_response
from conveyor.transport import RequestError

# room for a multipart form's boundaries and part headers around the file, in a Content-Length checked up front
_FORM_BYTES = 64 * 1024


class FileListQuery(msgspec.Struct, forbid_unknown_fields=True):
    purpose: str | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10_000
    after: str | None = None
    order: Literal["asc", "desc"] = "desc"


class FileRoutes(ServerRoutes):
    """The Files API's routes."""

    async def upload_file(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            store = self._files()
            # (the form parser spools a whole body to disk before its parts are seen: a body's length is bounded
            # up front, and uvicorn reads no byte past the length it gives)
            length = request.headers.get("content-length")
            if length is None or not length.isdigit():
                raise RequestError("an upload needs a Content-Length header (its size, checked against [batch] "
                                   "max_file_mb before it is read)", 411, "file")
            if int(length) > store.max_file_bytes + _FORM_BYTES:
                raise store.too_large()
            try:
                async with request.form(max_files=1, max_fields=8) as form:
                    upload, purpose = form.get("file"), form.get("purpose")
                    if not isinstance(upload, UploadFile):
                        raise RequestError("'file' is required: the file as a part of a multipart/form-data body",
                                           400, "file")
                    if purpose not in UPLOAD_PURPOSES:
                        allowed = ", ".join(repr(p) for p in UPLOAD_PURPOSES)
                        raise RequestError(f"purpose {purpose!r} is not served; allowed: {allowed}", 400, "purpose")
                    file_id, size = await anyio.to_thread.run_sync(store.write, upload.file)
            except HTTPException as e:  # (a body that is not a well-formed multipart form)
                raise RequestError(f"the body is not a multipart form with a file: {e.detail}", 400, "file") from None
            except ClientDisconnect:  # (nothing was kept; no one reads the answer)
                return Response(status_code=400)
            return json_response(store.record(file_id, upload.filename or file_id, purpose, size))
        except FileTooLarge as e:
            return error_response(RequestError(str(e), 413, "file"))
        except RequestError as e:
            return error_response(e)

    async def list_files(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            store = self._files()
            query = _query(request, FileListQuery)
            try:
                data, more = store.list(query.purpose, query.limit, query.after, query.order == "asc")
            except KeyError:
                raise RequestError(f"after = {query.after!r}: no such file", 400, "after") from None
        except RequestError as e:
            return error_response(e)
        return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def file(self, request: Request) -> Response:
        """GET: the file object; DELETE: the file removed."""
        if isinstance(stored := self._stored(request), Response):
            return stored
        store, found = stored
        if request.method == "DELETE":
            store.delete(found["id"])
            return json_response({"id": found["id"], "object": "file", "deleted": True})
        return json_response(found)

    async def file_content(self, request: Request) -> Response:
        if isinstance(stored := self._stored(request), Response):
            return stored
        store, found = stored
        return FileResponse(store.path(found["id"]), media_type="application/octet-stream")

    def _stored(self, request: Request) -> tuple[FileStore, dict[str, Any]] | Response:
        """The store and the file object the path's ``file_id`` names, or the refusal: 401 (the key), 404 (the
        Batch API is off, or no such file)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            store, file_id = self._files(), request.path_params["file_id"]
            try:
                return store, store.get(file_id)
            except KeyError:
                raise RequestError(f"no such file: {file_id!r}", 404, "file_id") from None
        except RequestError as e:
            return error_response(e)

    def _files(self) -> FileStore:
        if self.frontend.files is None:
            raise RequestError("the Batch API is off on this server: set [batch] dir to the folder that keeps its "
                               "files", 404)
        return self.frontend.files


def _query(request: Request, kind: type[FileListQuery]) -> FileListQuery:
    """A route's query parameters as ``kind``.

    Raises:
        RequestError: 400 naming the parameter that is unknown or out of range.
    """
    try:
        return msgspec.convert(dict(request.query_params), kind, strict=False)
    except msgspec.ValidationError as e:
        raise RequestError(f"query: {e}", 400) from None
