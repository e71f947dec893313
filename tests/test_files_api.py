"""OpenAI's Files API (/v1/files) on the shared server, driven by the openai client: a file comes back byte for
byte, lists page through every file once, a deleted file is gone, and what the API refuses is named; the files
and their records survive the store being opened again."""

from __future__ import annotations

import io
import os

import httpx
import openai
import pytest

from conveyor.batches.files import FileStore, FileTooLarge
from tests.conftest import BATCH_FILE_MB

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'


@pytest.fixture(scope="module")
def http(default_server):
    with httpx.Client(base_url=default_server.http, timeout=60) as http:
        yield http


def upload(client: openai.OpenAI, content: bytes, name: str = "lines.jsonl"):
    return client.files.create(file=(name, io.BytesIO(content)), purpose="batch")


def test_a_file_comes_back_byte_for_byte_until_it_is_deleted(openai_client):
    # (past the store's 1 MiB copy chunk, bytes of every value, a name outside ASCII)
    content = LINE * 3 + os.urandom(3 * 2**20 + 17) + "é\n".encode()
    made = upload(openai_client, content, "données.jsonl")
    assert (made.object, made.bytes, made.filename, made.purpose) == ("file", len(content), "données.jsonl", "batch")
    assert made.id.startswith("file-")
    assert openai_client.files.retrieve(made.id) == made
    assert openai_client.files.content(made.id).read() == content

    deleted = openai_client.files.delete(made.id)
    assert (deleted.id, deleted.deleted) == (made.id, True)
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.files.content(made.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.files.delete(made.id)


def test_pages_list_every_file_once_newest_first_or_oldest_first(openai_client):
    ours = [upload(openai_client, LINE * (i + 1)).id for i in range(5)]
    newest_first = [f.id for f in openai_client.files.list(limit=2, purpose="batch") if f.id in ours]
    assert newest_first == ours[::-1]  # (the client follows has_more and `after` from page to page)
    oldest_first = [f.id for f in openai_client.files.list(limit=3, order="asc") if f.id in ours]
    assert oldest_first == ours
    page = openai_client.files.list(limit=2, after=ours[2], order="asc")
    assert [f.id for f in page.data] == ours[3:] and page.has_more is False
    assert list(openai_client.files.list(purpose="batch_output")) == []
    for file_id in ours:
        openai_client.files.delete(file_id)


@pytest.mark.parametrize("size", [BATCH_FILE_MB * 2**20 + 1, BATCH_FILE_MB * 2**20 + 2**20],
                         ids=["read-past-the-limit", "longer-than-the-limit-said-up-front"])
def test_a_file_past_max_file_mb_is_refused_413_and_leaves_nothing(openai_client, default_server, size):
    folder = default_server.config_path.parent / "batch" / "files"
    before = sorted(folder.iterdir())
    with pytest.raises(openai.APIStatusError) as refused:
        upload(openai_client, b"x" * size)
    assert refused.value.status_code == 413
    error = refused.value.body
    assert error["param"] == "file" and f"max_file_mb = {BATCH_FILE_MB}" in error["message"]
    assert sorted(folder.iterdir()) == before


@pytest.mark.parametrize("request_kwargs, status, param, words", [
    ({"files": {"file": ("a.jsonl", LINE)}, "data": {"purpose": "fine-tune"}}, 400, "purpose",
     "purpose 'fine-tune' is not served; allowed: 'batch'"),
    ({"data": {"purpose": "batch"}}, 400, "file", "'file' is required"),
    ({"json": {"purpose": "batch"}}, 400, "file", "'file' is required"),
    ({"content": iter([b"--x\r\n", LINE]), "headers": {"content-type": "multipart/form-data; boundary=x"}}, 411,
     "file", "needs a Content-Length"),
], ids=["purpose", "no-file", "json-body", "no-length"])
def test_a_bad_upload_is_refused_naming_what_is_wrong(http, request_kwargs, status, param, words):
    response = http.post("/v1/files", **request_kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("query, param, words", [
    ({"limit": 0}, None, "limit"), ({"order": "sideways"}, None, "order"),
    ({"after": "file-none"}, "after", "no such file"), ({"colour": "red"}, None, "colour"),
])
def test_a_bad_listing_query_is_refused_naming_the_parameter(http, query, param, words):
    response = http.get("/v1/files", params=query)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_files_and_records_outlive_the_store_and_an_unfinished_upload_is_swept(tmp_path):
    store = FileStore(tmp_path, max_file_bytes=2**20)
    file_id, size = store.write(io.BytesIO(LINE * 7))
    made = store.record(file_id, "lines.jsonl", "batch", size)
    with pytest.raises(FileTooLarge):
        store.write(io.BytesIO(b"x" * (2**20 + 1)))
    store.close()
    (tmp_path / "files" / "file-cut.part").write_bytes(LINE[:10])  # (what a server killed mid-upload leaves)

    again = FileStore(tmp_path, max_file_bytes=2**20)
    assert again.get(file_id) == made
    assert again.path(file_id).read_bytes() == LINE * 7
    assert again.list(None, 10, None, ascending=True) == ([made], False)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [file_id]
