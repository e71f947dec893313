"""The built-in transports as the registry knows them before their code is imported: their options, and where
each class is (``conveyor.hookspecs.Declaration``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from conveyor.hookspecs import Declaration, hookimpl


class HTTPOptions(msgspec.Struct, forbid_unknown_fields=True):
    # interface to listen on; 127.0.0.1 keeps the server private to this machine
    host: str = "127.0.0.1"
    # 0 picks a free port
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    # name of an environment variable holding the API key clients must send as "Authorization: Bearer KEY" (or
    # "x-api-key: KEY"); empty: no key
    api_key_env: str = ""
    # largest request body, in bytes (HTTP 413 beyond)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024
    # seconds to wait for open connections when the server stops
    graceful_timeout: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    # Responses API: responses kept in memory for previous_response_id and GET /v1/responses/{id}, the oldest
    # dropped first (0: none kept)
    max_stored_responses: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # request fields the API does not have: false logs each name once and counts them on /metrics
    # (conveyor_request_unknown_fields_total), then ignores them; true refuses them with a 400 naming the field
    strict_requests: bool = False


class ZMQOptions(msgspec.Struct, forbid_unknown_fields=True):
    # where clients connect; tcp://127.0.0.1:* picks a free port
    address: str = "tcp://127.0.0.1:5556"
    # CURVE: the server's secret key file (zmq.auth.create_certificates makes NAME.key_secret) ...
    curve_secret_key_file: str = ""
    # ... and a directory of the public key files (*.key) of the clients allowed in
    curve_authorized_keys_dir: str = ""
    # largest message a client may send, in bytes; a client that sends a larger one is disconnected
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024
    # messages queued for one client that is not reading (beyond what the network holds); while its queue is
    # full, its requests wait (the other clients' do not) ...
    client_queue_messages: Annotated[int, msgspec.Meta(ge=1)] = 1000
    # ... and a client whose queue stays full this long has its requests aborted
    slow_client_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # the kernel's send buffer of each client connection (SO_SNDBUF), which holds what the queue has passed on;
    # 0: the system's, which grows to several MB for a client that does not read
    send_buffer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if bool(self.curve_secret_key_file) != bool(self.curve_authorized_keys_dir):
            raise ValueError("CURVE needs both curve_secret_key_file and curve_authorized_keys_dir (or neither)")


@hookimpl
def conveyor_register_transports(register) -> None:
    register(Declaration("http", HTTPOptions, "conveyor.plugins.transport.http:HTTPTransport",
                         "OpenAI-compatible HTTP."))
    register(Declaration("zmq", ZMQOptions, "conveyor.plugins.transport.zmq:ZMQTransport",
                         "External clients over a ZMQ ROUTER socket."))
